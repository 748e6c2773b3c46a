def summarize_orders(orders, tax_rate=0.2, currency="EUR"):
    """Summarize a list of orders into totals per customer and per product."""
    per_customer = {}
    per_product = {}
    skipped = []
    for order in orders:
        customer = order.get("customer")
        if not customer:
            skipped.append(order)
            continue
        items = order.get("items", [])
        if not items:
            skipped.append(order)
            continue
        order_total = 0.0
        for item in items:
            name = item["name"]
            quantity = int(item.get("quantity", 1))
            price = float(item["price"])
            line_total = quantity * price
            order_total += line_total
            entry = per_product.setdefault(name, {"quantity": 0, "revenue": 0.0})
            entry["quantity"] += quantity
            entry["revenue"] += line_total
        discount = float(order.get("discount", 0.0))
        if discount < 0 or discount > 1:
            raise ValueError(f"bad discount {discount} in order {order.get('id')}")
        order_total *= 1.0 - discount
        tax = order_total * tax_rate
        gross = order_total + tax
        stats = per_customer.setdefault(customer, {"orders": 0, "net": 0.0, "tax": 0.0, "gross": 0.0})
        stats["orders"] += 1
        stats["net"] += order_total
        stats["tax"] += tax
        stats["gross"] += gross
    best_customer = None
    best_gross = -1.0
    for customer, stats in per_customer.items():
        if stats["gross"] > best_gross:
            best_customer = customer
            best_gross = stats["gross"]
    best_product = None
    best_revenue = -1.0
    for name, entry in per_product.items():
        if entry["revenue"] > best_revenue:
            best_product = name
            best_revenue = entry["revenue"]
    report = {
        "currency": currency,
        "customers": per_customer,
        "products": per_product,
        "best_customer": best_customer,
        "best_product": best_product,
        "skipped": len(skipped),
    }
    total_net = sum(s["net"] for s in per_customer.values())
    total_gross = sum(s["gross"] for s in per_customer.values())
    report["total_net"] = round(total_net, 2)
    report["total_gross"] = round(total_gross, 2)
    return report
