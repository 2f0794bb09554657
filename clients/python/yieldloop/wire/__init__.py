"""The wire under :class:`yieldloop.client.Client`: calls with typed errors (:mod:`.calls`), episode streams
(:mod:`.episodes`), and the raw stubs (:mod:`.raw`, ``client.raw.<service>``) for callers that need the messages
themselves. Everything above this speaks :mod:`yieldloop.types`."""
