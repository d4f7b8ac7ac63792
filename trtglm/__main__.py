from trtglm.cli import main

main()
