"""The front end, in the caller's (API) process: :class:`~cadence.engine.async_engine.AsyncEngine`
and the offline :class:`~cadence.engine.llm.LLM`; admission (``admission``), the request manager,
the detokenizer and its actor, the data-parallel router, and the clients that reach an engine
core in this process (``inproc_client``) or in its own (``zmq_client``), wired by ``front_end``."""
