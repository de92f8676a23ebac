"""The patching machinery: who gets the engine, and how it is switched on.

``patcher`` installs and removes the wrapper around torch's ``all_gather``, and
hands the engine the settings each ``patch()`` runs under;
``callers`` finds the code that asked for a gather; ``targets`` (with
``releases``) says which callers are rewired; ``sites`` says where cat elision
is on by default, from the proof (``proof``, over ``flow``) on the call site's
source (``sources``), and ``callsites`` runs the same proof over an installed
library's files for ``memgather doctor``; ``scope`` is the explicit opt-out; ``autoload`` (run by
``memgather.pth``) and ``pytest_plugin`` switch memgather on without editing
the user's code.
"""
