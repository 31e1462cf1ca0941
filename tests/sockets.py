"""The TCP ports processes listen on, read from /proc (Linux): which addresses a server can be reached at."""
from __future__ import annotations

import ipaddress
import os


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _address(hex_ip: str) -> ipaddress._BaseAddress:
    raw = bytes.fromhex(hex_ip)
    # /proc/net/tcp{,6} print each 32-bit word of the address in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening(pids) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state held by one of `pids`."""
    out = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == "0A" and inode in inodes:
                    ip, port = local.split(":")
                    out.append((str(_address(ip)), int(port, 16), pid))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)
