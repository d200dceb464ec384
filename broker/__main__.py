"""``python -m broker serve``: the broker server (see `broker.server.run`)."""

from broker.server.run import main

main()
