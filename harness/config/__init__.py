"""harness/config"""
