"""Reading raw HTTP/1.1 answers off a socket, for the tests of the HTTP core and the tombstone."""

from __future__ import annotations


def parse_answers(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The ``Content-Length``-framed HTTP answers in ``data``, as ``(status, headers, body)``."""
    found = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        length = int(headers.get("content-length", 0))
        found.append((int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    return found
