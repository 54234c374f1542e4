"""What a launch waits for besides its checks, started while `campaign launch` checks the spec.

- **Prefect's temporary API server.** Without PREFECT_API_URL, Prefect starts a server of
  its own (a uvicorn process) the first time a flow needs its API, and a launch waited for it
  after every check had run (4-10 s on two cores). Started here, the process boots while the
  checks import and size the trials; the flow then finds it running (Prefect keeps one per
  process). If it fails to start, the flow's own start tries again and reports the error as
  it always has.
- **The MLflow store's tables.** A new SQLite store is created by MLflow's migrations
  (1.5-4 s on two cores), before the campaign's parent run can be opened; made here, the
  flow finds it ready. A failure is left for the flow to meet and report.

`ready()` waits for both (on one thread: they are made in order, the server's boot running in
its own process meanwhile).
"""

from __future__ import annotations

import os
import threading


class WarmUp:
    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri
        # A daemon thread: a launch refused for bad input exits at once, and Prefect's atexit
        # hook stops whatever was started.
        self.thread = threading.Thread(target=self._run, name="campaign-warm-up", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if not os.environ.get("PREFECT_API_URL"):  # else a server of the user's, the pool's or `campaign ui`'s
            from prefect.server.api.server import SubprocessASGIServer

            try:
                SubprocessASGIServer().start()
            except Exception:  # the flow's own start (the same server object) tries again, and says why
                pass
        if self.tracking_uri.startswith("sqlite:"):
            try:
                from mlflow import MlflowClient

                MlflowClient(tracking_uri=self.tracking_uri).search_experiments(max_results=1)
            except Exception:  # the flow opens the store again, and says what is wrong with it
                pass

    def ready(self) -> None:
        self.thread.join()
