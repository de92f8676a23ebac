"""The ``memgather`` command and what it runs: ``cli`` (the entry point),
``selftest`` and ``doctor`` (before switching on), ``bench`` with its
caller ``patterns`` and its other modes (``overhead``, ``route_times``,
``first_touch``, ``startup``), and ``rss`` (the resident set, measured).
"""
