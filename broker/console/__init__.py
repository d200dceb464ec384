"""The web console: topics, groups and their lag, dead letters, replay and purge, in a browser.

Served by the broker server (``[broker] console_port``) and by ``reliable
console --settings reliable.toml``. It logs users in with the broker's own
users and checks every page and action with the broker's own permissions
(`broker.console.access`); pages are rendered on the server, escaped, and
carry no script at all (a Content-Security-Policy forbids it).

The web parts (Starlette, Jinja2, uvicorn) are the optional extra
``reliable[console]``: import `broker.console.serving` only to serve.
"""
