from lighthouse.cli import main

main(prog_name="lighthouse")  # also under `python -m`: its usage lines and shell completion
