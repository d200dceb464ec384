"""The broker: a persistent commit log with topics, queues and consumer groups.

The broker knows nothing of `reliable` or `backends`; they adapt it. Its
storage layer lives in :mod:`broker.store`, its errors in :mod:`broker.errors`.
"""
