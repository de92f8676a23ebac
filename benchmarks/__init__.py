"""Scripts that measure the figures the README and docs/ quote, run from the repository root
(``python benchmarks/NAME.py --help``); not part of the installed package."""
