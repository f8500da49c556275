"""Declarations racing a server's death: the scheduler's side of a failover, driven step by step with a fake send."""

import threading

from gradwire.config import Config
from gradwire.protocol import messages
from gradwire.scheduler import moves
from gradwire.scheduler.declarations import Declarations
from gradwire.transport.tcp import ConnectionClosed


class Servers:
    """Stands for the servers' connections: records KEYS requests; a dead server's send fails, as a fenced one's."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, messages.Message]] = []
        self.dead: set[int] = set()
        self.got_keys = threading.Event()
        self.declarations: Declarations | None = None
        self.answer_at_once = True

    def send(self, server: int, body: messages.Keys) -> None:
        if server in self.dead:
            raise ConnectionClosed(f"server {server} closed the connection")
        self.sent.append((server, body))
        self.got_keys.set()
        if self.answer_at_once or server not in {1}:
            assert self.declarations is not None
            self.declarations.ack(body.id)


def _declarations(servers: Servers, num_workers: int = 2) -> Declarations:
    config = Config(timeout=30.0, partition_bytes=1024)
    d = Declarations(config, [1 << 20] * 3, servers.send, num_workers=num_workers)
    servers.declarations = d
    return d


def _declare(d: Declarations, rank: int, name: str, answers: dict, count: int = 4096) -> threading.Thread:
    body = messages.Declare(name=name, shape=[count], dtype="float32", partition_bytes=1024)
    thread = threading.Thread(target=d.declare, args=(rank, body, lambda reply: answers.__setitem__(rank, reply)))
    thread.start()
    return thread


def test_a_server_that_dies_while_its_keys_are_registered_neither_stalls_nor_fails_the_declaration():
    servers = Servers()
    servers.answer_at_once = False  # server 1 never confirms: it is dying
    d = _declarations(servers)
    answers: dict[int, dict] = {}
    threads = [_declare(d, r, "w", answers) for r in range(2)]
    servers.got_keys.wait(5)
    d.abandon(1)  # the scheduler sees it die: the wait for its confirmation ends at once, with no error
    with d.moving:
        moved = moves.evict(d, 1)
    for t in threads:
        t.join(5)
        assert not t.is_alive(), "the declaration still waits for the dead server"
    assert answers[0] == answers[1] and "error" not in answers[0]
    assert 1 not in d.tensors["w"].servers and moved == {"w": d.tensors["w"].servers}
    # a later declaration neither sends to the dead server nor waits for it
    servers.dead.add(1)
    threads = [_declare(d, r, "v", answers) for r in range(2)]
    for t in threads:
        t.join(5)
    assert "error" not in answers[0] and 1 not in answers[0]["servers"]


def test_a_send_to_a_server_that_just_died_is_not_the_declarers_error():
    servers = Servers()
    d = _declarations(servers)
    servers.dead.add(1)  # fenced, not yet abandoned: sending to it raises
    answers: dict[int, dict] = {}
    threads = [_declare(d, r, "w", answers) for r in range(2)]
    for t in threads:
        t.join(5)
    assert "error" not in answers[0] and answers[0] == answers[1]


def test_every_worker_gets_the_same_answer_when_a_failover_moves_the_keys_meanwhile():
    servers = Servers()
    d = _declarations(servers, num_workers=2)
    answers: dict[int, dict] = {}
    moving = d.moving
    moving.acquire()  # a failover is moving keys: the declaration's answer waits for it
    threads = [_declare(d, r, "w", answers) for r in range(2)]
    servers.got_keys.wait(5)
    assert not answers
    d.abandon(1)
    moved = moves.evict(d, 1)
    moving.release()
    for t in threads:
        t.join(5)
    assert answers[0] == answers[1] and answers[0]["servers"] == moved["w"]
    assert 1 not in answers[0]["servers"]
