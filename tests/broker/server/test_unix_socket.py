"""The native protocol on a unix socket beside TCP: both clients reach the same broker; only the owner may connect."""

from __future__ import annotations

import asyncio
import stat

from click.testing import CliRunner

from broker.async_client import AsyncClient
from broker.client import Client
from broker.delivery.values import OutgoingMessage
from reliable.cli import cli
from tests.broker.server.serving import ServerProcess


def test_clients_over_the_unix_socket_and_tcp_share_one_broker(tmp_path, unique) -> None:
    path = tmp_path / "run" / "broker.sock"
    settings = tmp_path / "reliable.toml"
    settings.write_text(f'[broker]\nunix_socket = "{path}"\n')
    server = ServerProcess(tmp_path / "data", "--settings", str(settings)).start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        local = Client(f"unix://{path}")
        local.publish(unique, [OutgoingMessage(b"over the socket", message_id="u1")])
        tcp = Client(server.url)
        member = tcp.join("g", [unique])
        assert [d.body for d in tcp.fetch(member, 10, 2.0)] == [b"over the socket"]

        async def from_asyncio() -> list[str]:
            async with AsyncClient(str(path)) as client:
                await client.publish(unique, [OutgoingMessage(b"again", message_id="u1")])  # a resend
                return [t.name for t in await client.topics()]

        assert unique in asyncio.run(from_asyncio())
        assert [t.messages for t in local.topics() if t.name == unique] == [1]  # the resend was dropped
        listed = CliRunner().invoke(cli, ["broker", "topics", "--url", f"unix://{path}", "--json"])
        assert unique in listed.stdout
        local.close()
        tcp.close()
    finally:
        assert server.stop() == 0
