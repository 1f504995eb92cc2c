from manager.cli import main

main()
