"""What a config is: its values (a flat JSON object served as ``dict[str, str]``), a job's JSON
Schema, and reading the ``--config``/``--schema`` files. The bottom floor: imports nothing of ours
but protos."""
