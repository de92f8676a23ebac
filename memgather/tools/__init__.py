"""The ``memgather`` command and what it runs: ``cli`` (the entry point),
``selftest`` and ``doctor`` (before switching on), ``bench`` with its
caller ``patterns`` (their code in ``pattern_code``), and ``rss`` (the
resident set, measured). The figures only the docs need are measured by the
repository's ``benchmarks/`` scripts, which use ``bench``'s helpers.
"""
