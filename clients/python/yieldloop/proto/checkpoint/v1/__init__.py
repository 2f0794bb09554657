"""Generated protobuf package (see protos/generate.py)."""
