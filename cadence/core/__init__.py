"""The engine core, in the engine-core process: the scheduler and its actor (the step loop), the
KV allocator with its block pool and events, structured output, step timing, and the process's
entry point (``core_process``). Nothing here imports the front end (:mod:`cadence.engine`)."""
