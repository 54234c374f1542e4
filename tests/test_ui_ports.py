"""`campaign ui` keeps its ports from one start to the next (flows/servers/ui.py: stable_ports), so
that the MLflow links written into Prefect artifacts still open after a restart."""

from __future__ import annotations

import socket

from flows.servers.ui import DEFAULT_PORTS, PORTS, Servers, port_is_free, remember_ports, stable_ports
from training.files import write_json_atomic


def test_the_ports_used_last_are_used_again_and_a_taken_one_gives_way(tmp_path):
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        prefect, mlflow = a.getsockname()[1], b.getsockname()[1]
    remember_ports(tmp_path, Servers(f"http://127.0.0.1:{prefect}", f"http://127.0.0.1:{mlflow}", ()))
    ports, notes = stable_ports(tmp_path, {"prefect": 0, "mlflow": 0})
    assert ports == {"prefect": prefect, "mlflow": mlflow} and notes == []
    with socket.socket() as held:  # someone else took the MLflow port meanwhile
        held.bind(("127.0.0.1", mlflow))
        held.listen()
        ports, notes = stable_ports(tmp_path, {"prefect": 0, "mlflow": 0})
    assert ports["prefect"] == prefect and ports["mlflow"] != mlflow and port_is_free(ports["mlflow"])
    assert len(notes) == 1 and f"port {mlflow} for mlflow is taken" in notes[0]


def test_ports_asked_for_win_and_a_new_folder_starts_from_the_tools_defaults(tmp_path):
    ports, _ = stable_ports(tmp_path, {"prefect": 4321, "mlflow": 0})
    assert ports["prefect"] == 4321
    expected = DEFAULT_PORTS["mlflow"] if port_is_free(DEFAULT_PORTS["mlflow"]) else None
    if expected is not None:
        assert ports["mlflow"] == expected
    write_json_atomic(tmp_path / PORTS, {"prefect": "junk"})  # a hand-edited file: the default, not a crash
    ports, _ = stable_ports(tmp_path, {})
    assert isinstance(ports["prefect"], int)
