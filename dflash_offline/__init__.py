"""The `dflash` command line, above both stages (it imports them)."""
