from lighthouse.cli import main

main()
