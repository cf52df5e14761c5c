"""The commands of ``python -m gpumempool`` (gpumempool/__main__.py), one module
each (``common`` holds what they share): each module's ``add_parser`` adds its
command, whose ``run(args)`` returns the exit status."""
