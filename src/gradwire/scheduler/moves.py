"""A dead server's keys moved, as its failover (failover.py) decides: onto the live servers (`evict`), to their
replicas, which hold their state (`move_to_replicas`), or registered again with the standby that takes its place
(`register_all`). Each blocks until the servers that now own the keys have confirmed them."""

from __future__ import annotations

from gradwire.scheduler.declarations import Declarations


def evict(declarations: Declarations, dead: int) -> dict[str, list[int]]:
    """Re-place every partition of server `dead` on the live servers and register the keys there (blocks until
    they confirm). Returns {tensor: its servers now} for the tensors that moved."""
    moved: dict[str, list[int]] = {}
    with declarations.lock:
        declarations.placement.remove(dead)
        for name, decl in declarations.tensors.items():
            lost = [j for j, s in enumerate(decl.servers) if s == dead]
            if not lost:
                continue
            servers = list(decl.servers)
            for j, server in zip(lost, declarations.placement.assign([decl.sizes[j] for j in lost]), strict=True):
                servers[j] = server
            decl.servers = servers
            moved[name] = servers
    for name, servers in moved.items():
        declarations.register_keys(name, declarations.tensors[name], only={s for s in servers if s != dead})
    return moved


def move_to_replicas(declarations: Declarations, dead: int) -> dict[str, list[int]]:
    """Move every replicated key of server `dead` to its replica, which holds its state (and register it there, as
    its primary now); keys replicated on `dead` lose their replica. Returns {tensor: its servers now}."""
    moved: dict[str, list[int]] = {}
    with declarations.lock:
        for name, decl in declarations.tensors.items():
            if decl.replicas is None:
                continue
            servers, replicas = list(decl.servers), list(decl.replicas)
            for j, (primary, copy) in enumerate(zip(servers, replicas, strict=True)):
                if primary == dead and copy is not None and copy not in declarations.placement.dead and copy != dead:
                    servers[j], replicas[j] = copy, None
                elif copy == dead:
                    replicas[j] = None
            if servers != decl.servers:
                moved[name] = servers
            decl.servers, decl.replicas = servers, replicas
    for name, servers in moved.items():
        decl = declarations.tensors[name]
        declarations.register_keys(name, decl, only={s for s in servers if s != dead})
    return moved


def register_all(declarations: Declarations, server: int) -> None:
    """Register every key of `server` with it again (a standby that took a dead server's place)."""
    with declarations.lock:
        owning = [(name, decl) for name, decl in declarations.tensors.items() if server in decl.servers]
    for name, decl in owning:
        declarations.register_keys(name, decl, only={server})
