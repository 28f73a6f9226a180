from yatrain.cli import main

main()
