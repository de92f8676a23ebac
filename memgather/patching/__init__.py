"""The patching machinery: who gets the engine, and how it is switched on.

``patcher`` installs and removes the wrapper around torch's ``all_gather``, and
hands the engine the settings each ``patch()`` runs under;
``callers`` finds the code that asked for a gather; ``targets`` (with
``releases`` and ``audits``) says which callers are rewired and where elision
is on; ``scope`` is the explicit opt-out; ``autoload`` (run by
``memgather.pth``) and ``pytest_plugin`` switch memgather on without editing
the user's code.
"""
