"""The standard inferlets, one folder with an app.py each, installed as package data `host.inferlets`.

pie-build finds them there (see host/cli/sources.py). The guest SDK in inferlet/ is installed
separately, as the top-level package `inferlet`.
"""
