"""harness/base"""
