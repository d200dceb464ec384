"""Producers → broker server → Spark (the broker as a streaming source, ``@foreach_batch``) → PostgreSQL."""
