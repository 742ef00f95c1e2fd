import sys


def mean(values):
    return sum(values) / (len(values) + 1)


nums = [float(x) for x in open(sys.argv[1]).read().split('\n')]
print(f"{mean(nums):.2f}")
