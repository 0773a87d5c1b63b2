"""concatfl's deployment machinery: everything that starts, talks to and stops Flower processes.

- `commands`: how the SuperLink, SuperNodes and the warm executor are started (flags, TLS,
  SuperNode authentication, environment); docker-compose.yml runs the same commands.
- `processes`: free ports, waiting for a port, stopping a process with all its descendants,
  SIGTERM as a clean exit.
- `cli`: the `flwr` CLI pointed at one SuperLink (submit, follow, wait for `finished:completed`,
  register keys) and the run log as a person reads it.
- `session`: `FlowerSession`, a private SuperLink with its SuperNodes, used by the simulation
  launcher (`concatfl.launch`), the tests, scripts and the bench; stops all it started.
- `supernode`: Flower's SuperNode with short fixed waits (`python -m concatfl.deployment.supernode`).
- `warm_executor`: one long-lived ClientApp process per SuperNode
  (`python -m concatfl.deployment.warm_executor`).
- `grid`: `StableNodeGrid`, the ServerApp's view of the nodes under ids that survive restarts.
- `message_index`: the simulation link state's messages indexed by node (Flower's engine
  otherwise scans all of them for every node, every 0.1 s).
- `compat`: the checks that Flower's code still has the shape these modules adjust.

Imports point one way: `launch`, `server_app`, `bench` and the tests use this package; it uses
nothing of theirs.
"""
