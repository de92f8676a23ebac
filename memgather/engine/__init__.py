"""The per-call engine: what happens to one ``all_gather`` call.

Read top to bottom, three files tell the whole path: ``core`` (plan, agree,
lay out, move, count), ``planner`` (the decision: strategy, route, or the
reason to leave the call to torch) and ``routes`` (how the bytes travel).
The rest serve them: ``strategies`` (what the arguments allow; ``reasons``
names the strategies and the reasons to fall back), ``cuda_memory`` (whether a
CUDA slot may be released and rebound), ``agreement``
and ``hosts`` (the ranks' one small exchange), ``groups`` (what is known of a
process group), ``slots`` and ``pages`` (the output's memory), ``elision``
(cat / stack returning the buffer itself), ``verification`` (verify mode),
``counters`` and ``report`` (what memgather did).
"""
