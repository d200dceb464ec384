"""The native protocol, shared by the broker server and its clients: frames, tables, operations."""
