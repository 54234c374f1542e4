"""A campaign pool: one campaign's trials on several nodes, through a Prefect work pool.

- `nodes`: the pool as Prefect holds it (the work pool, a queue and a Variable per node, liveness);
- `secret`: who may drive it (the server's API auth) and which segments a node runs (signed);
- `worker`: `campaign worker`, a node joining the pool;
- `remote`: the campaign's side, one flow run per node of a trial;
- `segment`: the flow a node runs for its part of a trial;
- `relay`: an elastic trial's resize commands, leased on the node before its agent sees them.
"""
