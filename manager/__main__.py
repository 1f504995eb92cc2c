from manager.cli import main

main(prog_name="manager")  # also under `python -m`: its usage lines and shell completion
