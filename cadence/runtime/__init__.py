"""The actor runtime and the transport between processes: actors and their inboxes
(``actor``), the receiving side of a channel (``channel``), msgpack frames (``codec``), ZMQ
channels (``zmq_channel``), the actor that joins a channel to inboxes (``forwarder``), and what a
child process does for itself (``processes``). Nothing here knows the engine's components."""
