"""The SWE track's tiny coding model: its corpus (scripted agents on the held-in tasks) and its
build. Imports the tiny world (its model, template and trainer loop) and the SWE environment."""
