from shop.prices import total


def run():
    print(f"total: {total([40, 2])}")


if __name__ == "__main__":
    run()
