"""Profile data (JSON): a package so that setuptools ships the *.json files in wheels and images."""
