"""Where the engine runs, behind engine/interface.py's `ServedEngine`: in the server's process,
stepped by a thread of its own (local.py), or in a process of its own (core.py, the loop that
process runs; client.py, the server's end of its pipe).

Nothing is imported here: the spawned engine process imports core.py alone, and the server's
process needs none of them until it has chosen.
"""
