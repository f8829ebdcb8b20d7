"""Helpers the tests use that are not tests: servers, fake hosts, networks."""
