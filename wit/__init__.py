"""The WIT world inferlets target (inferlet.wit), installed as package data `host.wit` for pie-build."""
