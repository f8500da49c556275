"""The summation server role."""

from gradwire.server.server import Server

__all__ = ["Server"]
