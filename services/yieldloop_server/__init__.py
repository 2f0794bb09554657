"""The yieldloop servers: one package per service process, plus shared parts.

Each service folder holds ``server.py`` (wiring, start/stop), ``servicer.py``
(protobuf <-> domain translation only) and domain modules that never import grpc.
"""
