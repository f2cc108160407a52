"""The demos `make demo` (`python -m demo.files`) and `make demo-api` (`python -m demo.api`) run.

Each builds a lab (the `lab` package), runs real agents in it, shows what they do and tears it down.
"""
