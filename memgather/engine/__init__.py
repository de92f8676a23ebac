"""The per-call engine: what happens to one ``all_gather`` call.

Three files tell the whole path, each read top to bottom:

- ``core``: the path itself. Bind the call (``call``), plan it, agree where the
  plan says so, execute the plan's strategy through one table of writers, count.
- ``planner``: the plan (``plan.Plan``: strategy, route, whether the ranks must
  agree, the reason to leave the call to torch), made in one function, once.
- ``agreement``: the ranks' one small exchange, and ``settle``, the only step
  that may turn a plan into another.

The rest serve them: ``strategies`` (what a rank's slots and input allow;
``reasons`` names the strategies and the reasons to fall back), ``routes``
(how the bytes travel), ``cuda_memory`` (whether a CUDA slot may be released
and rebound), ``hosts``, ``groups`` and ``group_facts`` (what is known of the
ranks, the group, and what calls on it take), ``slots``, ``staged`` and ``pages`` (the output's memory),
``elision`` (cat / stack returning the buffer itself), ``verification``
(verify mode), ``counters`` and ``report`` (what memgather did).

The engine imports ``memgather.compat``, ``config``, ``cuda_watch``, ``errors`` and ``frames``,
never the patching layer above it.
"""
