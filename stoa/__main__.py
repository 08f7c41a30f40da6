from stoa.cli import main

main()
