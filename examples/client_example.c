/*
 * client_example.c - a solver using libtorchloop: a cumulative sum over 8
 * steps of a 4-vector, printed as "carry: ..." (the README and the tests use
 * it).  Build: cc client_example.c $(pkg-config --cflags --libs torchloop)
 * usage: client_example SOCKET ADAPTER
 */
#include <stdio.h>
#include <torchloop.h>

int main(int argc, char **argv)
{
	double carry[4] = {0, 1, 2, 3}, xs[8][4];
	int64_t cshape[] = {4}, xshape[] = {8, 4};
	struct tl_client *c;
	struct tl_builder *b = tl_builder_new();
	struct tl_reply *r;
	struct tl_error err;
	const double *out;

	if (argc != 3)
		return 2;
	for (int t = 0; t < 8; t++)
		for (int k = 0; k < 4; k++)
			xs[t][k] = 0.5 * (t + 1);
	if (tl_connect(argv[1], 5000, &c, &err) != 0 || tl_hello(c, &err) != 0 ||
	    tl_scan(c, argv[2], tl_tensor(b, TL_FLOAT64, 1, cshape, carry),
		    tl_tensor(b, TL_FLOAT64, 2, xshape, xs), &r, &err) != 0) {
		fprintf(stderr, "%s: %s\n", err.code, err.message);
		return 1;
	}
	out = tl_tree_data(tl_reply_tree(r, "carry"));
	printf("carry: %g %g %g %g\n", out[0], out[1], out[2], out[3]);
	tl_reply_free(r);
	tl_close(c);
	tl_builder_free(b);
	return 0;
}
