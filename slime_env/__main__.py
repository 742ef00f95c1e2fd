from slime_env.cli import main

main()
