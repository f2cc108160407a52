"""The settings table and what is generated from it (see table.py for how to add a setting)."""
