"""The operator application: the `arlo` command (cli), the run driver, the live view, the local
cluster (services as subprocesses beside a local Redis, under a supervisor) and the run record.

Nothing under services/ imports it: the services depend on the shared library in arlo/ only.
"""
