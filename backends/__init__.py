"""Pluggable parts of `reliable`, each chosen by the scheme of a URL.

Three families, one folder each: ``cache/`` (seen-token lookups), ``store/``
(the durable token table, offsets, dead letters) and ``transport/`` (how
messages arrive and are acknowledged). ``types`` holds the values they share
with the framework; ``errors`` the root of every error the project raises.
"""
