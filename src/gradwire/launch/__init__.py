"""The command line: `gradwire scheduler | server | launch | bench`."""
