"""TCP stores that listen on one address only: loopback, or the node's own address.

torch's TCPStore server listens on every interface (`*:port`), and torchrun hosts two of
them per trial. On one machine nothing needs to reach them from outside, and anyone on the
network could otherwise write into a trial's rendezvous. A store given an already-bound
listening socket (`master_listen_fd`) listens on that socket's address instead, so we bind
it ourselves: to 127.0.0.1, or, for a trial that spans nodes, to the address of the node
named in $CAMPAIGN_BIND_ADDR (the one its peers reach it at), never to every interface.

`python -m training.launch` runs torchrun with every store it hosts made this way.
"""

from __future__ import annotations

import importlib
import os
import socket
from datetime import timedelta

_TCPStore = None  # torch's own TCPStore, kept before patch_torch_stores replaces it (torch imported when needed)
_PARAMS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant", "master_listen_fd", "use_libuv")


BIND_ENV = "CAMPAIGN_BIND_ADDR"


def bind_address() -> str:
    """Where this process's stores listen: 127.0.0.1 unless the trial spans nodes."""
    return os.environ.get(BIND_ENV) or "127.0.0.1"


def loopback_listener(port: int = 0, address: str | None = None) -> int:
    """A socket listening on address:port (default bind_address(); port 0: any free one);
    returns its fd, owned by the caller."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address or bind_address(), port))
    sock.listen(4096)
    return sock.detach()  # the store owns the fd from here on


def _torch_store():
    global _TCPStore
    if _TCPStore is None:
        import torch.distributed as dist

        _TCPStore = dist.TCPStore
    return _TCPStore


def loopback_store(port: int = 0, timeout: timedelta = timedelta(seconds=300), address: str = "127.0.0.1", **kwargs) -> "dist.TCPStore":
    """A TCPStore server on 127.0.0.1, or on `address` alone (port 0: a free one; read it back from `.port`)."""
    return _torch_store()(address, port, is_master=True, timeout=timeout, master_listen_fd=loopback_listener(port, address), **kwargs)


def _store(*args, **kwargs) -> "dist.TCPStore":
    """TCPStore as torch calls it, except that a server listens on bind_address() only."""
    named = dict(zip(_PARAMS, args)) | kwargs
    if named.get("is_master") and named.get("master_listen_fd") is None:
        named["master_listen_fd"] = loopback_listener(int(named.get("port", 0)))
        named["use_libuv"] = True  # the listening fd is only taken by the libuv server
    return _torch_store()(**named)


def patch_torch_stores() -> None:
    """Every TCPStore server made in this process from here on listens on bind_address() only."""
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
    import torch.distributed.elastic.utils.distributed as elastic_distributed

    _torch_store()  # the original, before it is replaced
    dist.TCPStore = _store  # dynamic_rendezvous and elastic.utils.distributed call it through the module
    c10d_backend.TCPStore = _store  # imported by name there
    # And in a worker: rank 0 hosts the process group's store itself when the agent's is not
    # shared (a trial elastic across nodes, tasks/trial.py plan_node_launch). The module, not
    # `torch.distributed.rendezvous`: that name is the function the package re-exports.
    importlib.import_module("torch.distributed.rendezvous").TCPStore = _store
    assert elastic_distributed.dist is dist
