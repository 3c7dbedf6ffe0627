"""The `clawrl` command (main.py dispatches to subcommands by module name) and `clawrl up`
(stack.py, the whole stack on one machine). The top of the house: may import any room."""
